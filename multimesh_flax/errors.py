"""User-facing error classes of multimesh_flax.

Every mistake a user can make with the public API raises one of these classes. Each one
subclasses ``ValueError`` or ``TypeError`` (so generic handlers keep working) and its message
says what was expected, what was received, and what to do instead.

The classes are named ``<Problem>Error`` and grouped by topic: meshes and devices; tasks and
name-based registration; compiler switches; logical sharding and placement (with
``PlacementWarning``, the one warning class); transformations (``jit``, ``parallelize``);
microbatching and pipeline schedules; Flax NNX; checkpoints; the reference models and
pretrained checkpoints (`models`); timelines; multi-process runs. Tests assert the class, so
a class, once published, keeps its meaning. The ``mmflax`` command line's own errors live
with it, in `multimesh_flax.cli.errors`.
"""

from __future__ import annotations


class MultiMeshError(Exception):
    """Base class of every error raised for a user mistake."""


# --- meshes and devices ---------------------------------------------------------------------


class MeshShapeError(MultiMeshError, ValueError):
    """Mesh axis names, sizes and devices disagree.

    Raised when the number of devices is not the product of the axis sizes, or when the
    number of axis names differs from the number of axis sizes. Fix the sizes so their
    product equals the device count, or pass exactly as many names as sizes.
    """


class DuplicateDeviceError(MultiMeshError, ValueError):
    """A device (or device position) appears more than once in one mesh.

    A mesh is a grid of *distinct* devices. List each device once.
    """


class UnknownMeshAxisError(MultiMeshError, ValueError):
    """An axis name that the mesh does not have was used (in ``slice`` or ``mesh_slice``).

    Use one of the mesh's ``axis_names``.
    """


class MeshIndexError(MultiMeshError, ValueError):
    """An index or device position lies outside what the mesh or device list holds.

    Raised for ``MultiMesh.slice(stage=5)`` on a 2-stage mesh, an index that is not an
    integer (``stage=1.0``), a ``TaskMesh`` position beyond the executable's device list, or
    an integer device position beyond ``jax.devices()``. Use an integer in ``[0, size)``.
    """


class NoMultiMeshError(MultiMeshError, ValueError):
    """Something needs the current ``MultiMesh`` but none is active.

    ``Task(mesh_slice=...)`` and ``slice_global_mesh`` resolve against the innermost
    ``with multi_mesh:`` block. Open one, or give the task an explicit ``mesh``.
    """


class DevicePositionError(MultiMeshError, TypeError):
    """A device list holds something that is neither a jax device nor an integer position.

    ``TaskMesh(devices=...)`` takes *positions* ``0..N-1`` in the executable's device list
    (``range(4)``), not ``jax.Device`` objects or ids of another type. To pin a task to
    particular devices, pass a ``jax.sharding.Mesh`` as ``mesh=``, or the devices as
    ``task(..., devices=...)``. The ``devices`` of ``task``, ``jit``, ``parallelize`` and
    ``MultiMesh`` take jax devices or integer positions (in the executable's device list for
    ``task``, in ``jax.devices()`` for the others); a string or other object raises this.
    """


# --- tasks and name-based registration ------------------------------------------------------


class InvalidTaskError(MultiMeshError, ValueError):
    """A ``Task`` was given contradictory or incomplete arguments.

    For example both ``mesh`` and ``mesh_slice``, ``logical_axes`` with no mesh to map
    them onto, or a field of the wrong form (a ``name`` that is not a string, a
    ``mesh_slice`` that is not a ``{axis: index}`` mapping).
    """


class TaskTypeError(MultiMeshError, TypeError):
    """An argument that must be a ``Task``, ``TaskMesh``, mesh or Flax module has another type.

    Also raised when a function to run as a task is not callable, or when a Flax module
    *instance* is given where the module *class* is expected (``task(nn.Dense)``, not
    ``task(nn.Dense(4))``) or the other way round (``tabulate(Model(...), ...)``).
    """


class TaskInControlFlowError(MultiMeshError, ValueError):
    """A task boundary sits inside ``lax.scan``, ``lax.cond``, ``lax.while_loop`` and the like.

    A loop or conditional runs as one unit on one submesh, so a task cannot start inside
    it. Move the task call outside the loop (unroll it in Python), or make the whole loop
    one task.
    """


class InvalidMatcherError(MultiMeshError, ValueError):
    """A ``register_task`` matcher is not a valid regular expression (or not a string).

    Matchers are regexes matched in full against named-scope names and Flax module paths.
    Fix the pattern, or wrap a literal name in ``re.escape``.
    """


class TaskRegistrationError(MultiMeshError, ValueError):
    """``register_task`` got neither or both of ``callback`` and ``task``.

    Pass ``task=Task(...)`` to run every matched name as that task, or
    ``callback=fn`` with ``fn(matched_name, backprop) -> Task`` to choose per name and pass.
    """


class TaskCallbackError(MultiMeshError, TypeError):
    """A ``register_task`` callback is not callable or did not return a ``Task``.

    The callback is called as ``callback(matched_name, backprop)`` while a program is traced
    and must return a ``Task`` (for example ``Task(mesh_slice={"stage": 0})``). The message
    names the matcher, the matched name and what the callback returned.
    """


class RecomputePolicyError(MultiMeshError, ValueError):
    """A ``recompute`` option (of ``task``, ``Task`` or ``parallelize_step``) is not a policy.

    Accepted: ``None`` (unset: inherit), ``False``/``"none"`` (off), ``True``/``"full"``
    (keep only the task's inputs), ``"dots"`` (also keep matrix products without batch
    dimensions), or a ``jax.checkpoint_policies`` callable such as
    ``jax.checkpoint_policies.checkpoint_dots``. A misspelt name or another type raises this
    instead of silently keeping every activation.
    """


# --- compiler switches (context, autoshard, strict, ...) ------------------------------------


class ContextFlagError(MultiMeshError, ValueError):
    """A compiler switch got a value that is not a bool, or a switch name does not exist.

    ``autoshard``, ``enable_fast_path``, ``enable_recomputation``, ``ignore_transforms`` and
    ``strict`` take ``True`` or ``False`` (``context`` also ``None`` for "unchanged"); a string
    such as ``"false"`` would otherwise silently turn the switch on. ``get_flag`` knows exactly
    those five names.
    """


# --- logical sharding and placement ---------------------------------------------------------


class LogicalRulesError(MultiMeshError, ValueError):
    """Logical axis rules are malformed or name a mesh axis that does not exist.

    Rules are a sequence of ``(logical_name, mesh_axis)`` pairs, where ``mesh_axis`` is
    one of the task mesh's ``axis_names`` (or ``None`` to replicate).
    """


class PartitionSpecError(MultiMeshError, ValueError):
    """A ``PartitionSpec`` does not fit the array it is applied to.

    The spec has more entries than the array has dimensions (give at most ``ndim`` entries),
    or is not a ``PartitionSpec`` at all (write ``P("batch", None)``, not a tuple or a string).
    """


class UnevenShardingError(MultiMeshError, ValueError):
    """A dimension does not divide evenly over the mesh axes a rule maps it to.

    Pad the dimension to a multiple of the shard count (for example a byte vocabulary of
    259 to 264), or map its logical name to a smaller mesh axis.
    """


class UnmappedLogicalAxisError(LogicalRulesError):
    """A task-wrapped NNX variable names a logical axis that no rule of its task mentions.

    ``Task[Block]`` creates each variable sharded by its ``out_sharding`` logical names through
    the task's rules. A name the rules do not mention at all is almost always a typo or a
    forgotten rule, so it is an error rather than a silent replication. Add a rule to
    ``logical_axes``: ``(name, None)`` to replicate, ``(name, "<mesh axis>")`` to shard.
    """


class UnplacedVariableError(MultiMeshError, ValueError):
    """An NNX variable with sharding metadata was created outside every mesh.

    ``nnx.with_partitioning(init, names)`` asks NNX to shard the variable when it is created,
    which needs a mesh. Create the module through ``multimesh_flax.task(Block, ...)`` (its
    variables are born on the task's submesh), inside ``jax.set_mesh(mesh)``, or with
    ``nnx.use_eager_sharding(False)`` to create it unsharded.
    """


class PlacementWarning(UserWarning):
    """Something runs, but probably not where or how it was meant to.

    Warned (once per cause) when a ``register_task`` pattern matched no name in a traced
    program, a logical axis name has no rule, a task is traced by a JAX transformation other
    than ``multimesh_flax.jit``/``parallelize`` (so it is not placed), or a ``MultiMesh`` with
    registered tasks is used outside its ``with`` block. The message says what happened and
    how to get the other behaviour. Under ``context(strict=True)`` these become errors
    (``StrictModeError``); to silence one, filter this class with ``warnings.filterwarnings``.
    """


class AxisTypeError(MultiMeshError, ValueError):
    """Sharding in types (``jax.sharding.reshard``, ``out_sharding=``) inside a task whose
    submesh has Auto axes.

    Inside a task its submesh is the ambient mesh, with the axis types of the ``MultiMesh``
    (or ``TaskMesh``/``jax.sharding.Mesh``) it was given; ``MultiMesh(axis_sizes=...)`` makes
    them ``Auto``, where JAX refuses ``reshard`` onto named axes. Build the mesh with Explicit
    axes (``MultiMesh(global_mesh=jax.make_mesh(...))``, ``MultiMesh(...,
    axis_types=(AxisType.Explicit,) * n)``), or use ``mm.with_sharding_constraint`` with
    logical names on Auto axes.
    """


class StrictModeError(MultiMeshError, ValueError):
    """A ``PlacementWarning`` raised as an error because ``context(strict=True)`` is on.

    The message is the warning's: it names what would have been placed differently from what
    the program says, and how to fix it.
    """


# --- transformations (jit, parallelize, their arguments) ------------------------------------


class ParallelizeArgumentError(MultiMeshError, ValueError):
    """``parallelize`` or ``jit`` was given arguments it cannot use.

    For example both ``get_input_batch`` and ``initial_batch``, or ``devices`` of the
    wrong kind.
    """


class StaticArgumentError(MultiMeshError, TypeError):
    """A static argument is not hashable, or an index in ``static_argnums`` is invalid."""


class ConsumedArrayError(MultiMeshError, ValueError):
    """An input array was donated to an earlier call and no longer exists.

    ``parallelize_step``'s ``step_fn`` donates the train state, and ``jit(...,
    donate_argnums=...)`` the arguments named there: the call reuses their buffers for its
    outputs, so the arrays passed in are deleted. Passing the same arrays again (``loss, new =
    step(state, x)`` twice, forgetting to rebind ``state``) would crash the process. Use the
    state or outputs the earlier call returned: ``loss, state = step(state, x)``.

    Also raised when a call in another thread is consuming the same arrays at that moment
    (two threads stepping one state): step one state from one thread.
    """


class DonationError(MultiMeshError, ValueError):
    """``donate_argnums`` names something a call cannot consume.

    A donated argument's buffers are reused for the call's outputs, so it must be an array
    argument the call receives once: not a static argument (``static_argnums``), not a
    position beyond the call's positional arguments, and not an array also passed in another
    position of the same call (``f(x, x)`` with argument 0 donated would read a buffer it has
    already consumed, which crashes XLA). Remove the position from ``donate_argnums``, or
    pass a copy (``jnp.copy(x)``) in the other position.
    """


class NonFiniteError(MultiMeshError, ValueError):
    """A training step built with ``parallelize_step(..., nonfinite="raise")`` produced a
    non-finite loss or gradient norm (NaN or inf), so its update was not applied.

    Usual causes: a learning rate too high for the model (the loss grows until it
    overflows), a batch holding NaN/inf or out-of-range values, or weights that were already
    broken when training started. The message names ``state.step`` and which of the loss
    and the gradient norm was non-finite. Because the step donates the state passed in,
    the unchanged, still-valid state is attached as ``error.state``: keep training from it
    (``state = error.state``) or save it. Lower the learning rate (or clip the gradient
    norm with ``optax.clip_by_global_norm``), check the data, or build the step with
    ``nonfinite="skip"`` to drop such steps and go on.

    Attributes:
        state: The training state as it was before the step (nothing applied).
        step: ``int(state.step)``, the number of updates applied so far.
        loss: The step's loss as a Python float (``nan``/``inf`` when non-finite).
        grad_norm: The global norm of the step's gradients as a Python float.
    """

    def __init__(
        self, message: str, *, state: object = None, step: int = -1,
        loss: float = float("nan"), grad_norm: float = float("nan"),
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.state, self.step, self.loss, self.grad_norm = state, step, loss, grad_norm


# --- microbatching and pipeline schedules ---------------------------------------------------


class UnevenMicrobatchError(MultiMeshError, ValueError):
    """``microbatch``'s ``size`` does not divide the batch, or the batch leaves disagree.

    Every leaf of the split argument must have the same length along ``dim``, and that
    length must be a multiple of ``size`` (nothing is dropped silently). Pick a ``size``
    that divides the batch, or pad or trim the batch to a multiple of ``size``.
    """


class MicrobatchAxisError(MultiMeshError, ValueError):
    """``microbatch`` cannot find the axis or argument to split.

    ``dim`` must be an axis of every array leaf of argument ``argnum`` (negative values count
    from the end), and ``argnum`` must name a positional argument of the call. Fix ``dim``
    or ``argnum``, or pass the batch positionally.
    """


class MicrobatchArgumentError(MultiMeshError, ValueError):
    """``microbatch`` was given an option it cannot use.

    ``size``, ``num_stages`` and ``interleave`` are positive integers, ``reduce`` is
    ``"sum"`` or ``"mean"``, and ``custom_schedule`` goes with ``schedule="custom"``. The
    message names the argument and the accepted values.
    """


class InvalidScheduleError(MultiMeshError, ValueError):
    """A pipeline schedule cannot run as given, or cannot be built from the given arguments.

    Raised for an unknown schedule name, a stage count that the submeshes do not divide, an
    op that appears twice, is missing, or sits on a row (submesh) its stage does not belong
    to, an order that deadlocks (a row waits for an op that another row only runs after
    something that waits in turn), and simulation costs that are negative or name an unknown
    phase. The message names the offending op as ``<phase><stage>.<microbatch>`` (``B1.3``)
    and says how to fix it; most often, reorder the row so every op comes after the ops it
    depends on.
    """


# --- Flax NNX -------------------------------------------------------------------------------


class GraphArgumentError(MultiMeshError, ValueError):
    """``multimesh_flax.jit`` got NNX graph objects it cannot carry through the program.

    Raised when the jitted function returns an NNX graph object (return arrays; the graph
    objects passed in are updated in place), or when an ``nnx.Optimizer``'s state does not
    belong to the model passed to ``optimizer.update`` (build the optimizer from that model:
    ``nnx.Optimizer(model, tx, wrt=nnx.Param)``).
    """


# --- checkpoints ----------------------------------------------------------------------------


class CheckpointNotFoundError(MultiMeshError, ValueError):
    """No finalized checkpoint exists where one was asked for.

    Raised when the directory does not exist or holds no finalized step (a save that was
    interrupted midway does not count), or when the requested ``step`` is not among the
    saved ones. The message lists the saved steps; pass one of them, or ``None`` for the
    latest.
    """


class CheckpointStepError(MultiMeshError, ValueError):
    """A checkpoint was saved under a step that is not new.

    Steps must be non-negative integers, each greater than the latest saved step (orbax
    would otherwise skip the save silently). Save under a larger step, or into a fresh
    directory.
    """


class CheckpointMismatchError(MultiMeshError, ValueError):
    """A restore ``target`` does not have the saved state's tree paths, shapes or dtypes.

    The message names the first mismatching path with the saved and the received shape and
    dtype. Build the target from the same model and optimizer configuration as the saved
    state (the metadata saved with the checkpoint can hold that configuration).
    """


class CheckpointMetadataError(MultiMeshError, TypeError):
    """Checkpoint metadata is not a JSON-serializable dict.

    Metadata is stored as JSON. Convert arrays with ``.tolist()``, dataclasses with
    ``dataclasses.asdict``, and keep keys strings.
    """


class CheckpointReadOnlyError(MultiMeshError, ValueError):
    """``save`` was called on a ``Checkpointer`` opened with ``read_only=True``.

    A read-only checkpointer restores without creating, writing or cleaning up anything.
    Open the directory with ``Checkpointer(directory)`` to save into it.
    """


class CheckpointArgumentError(MultiMeshError, ValueError):
    """A ``Checkpointer`` or ``save`` got an argument it cannot use.

    Raised, before anything is written, when ``directory`` is an existing file, when
    ``max_to_keep`` is not a positive integer (or ``None``), or when the state to save is
    ``None``, holds no arrays, or has a leaf orbax cannot store (a string, an object). Save
    arrays, numpy arrays and Python numbers; keep strings in the JSON ``metadata``.
    """


class CheckpointSaveError(MultiMeshError, ValueError):
    """A checkpoint could not be written: the folder is read-only, the disk is full, ...

    Raised by ``Checkpointer.save`` (or, for a background save, by ``wait_until_finished``,
    ``close``, leaving the ``with`` block, or the next ``save``) with the step, the
    directory and the operating system's reason. The step is not saved (its temporary
    folder, if any, is ignored by later runs); earlier steps are intact. Free space, make the
    folder writable, or save into another folder. A background save that fails while the
    interpreter exits is logged once and the process exits with status 1.
    """


class CheckpointCorruptError(MultiMeshError, ValueError):
    """A saved checkpoint's files are damaged: changed bytes, truncated or missing files.

    Raised by ``restore`` when a leaf's checksum (saved with it) does not match what was
    read, or when a file of the step cannot be read (truncated, deleted, not JSON). The
    message names the step, the file or leaf path, and the other saved steps: restore an
    earlier one (``restore(step=...)``), or copy the checkpoint again from a good source.
    """


# --- reference models and pretrained checkpoints (models, models.hf) ------------------------


class ModelConfigError(MultiMeshError, ValueError):
    """A reference-model configuration (``models.get_config``, ``ModelConfig``) is invalid.

    Raised for an unknown preset name, an override that names no ``ModelConfig`` field, or
    sizes that do not fit together (``num_kv_heads`` not dividing ``num_heads``, a
    non-positive size, ``dropout_rate`` outside ``[0, 1)``). The message lists the valid
    names or says which value to change.
    """


class SequenceLengthError(MultiMeshError, ValueError):
    """A reference model got a sequence longer than its ``config.max_len``.

    GPT's learned position table has ``max_len`` rows: positions past it would read outside
    the table (a silent NaN loss); Llama's rotary positions would run past the context the
    model was configured (or pretrained) for. The check runs while the model is traced, on
    the static sequence length (and on concrete ``positions``), so it fires before the first
    step. Train or evaluate on shorter sequences (``seq_len``), or use a config with a
    larger ``max_len`` (``get_config(name, max_len=...)``). A config with a
    ``sliding_window`` (Mistral) also refuses sequences longer than the window, which the
    reference attention (over every earlier position) would compute differently.
    """


class PretrainedConfigError(MultiMeshError, ValueError):
    """A Hugging Face model folder has no readable ``config.json`` or no weights.

    Raised by ``models.hf.load`` when the folder does not exist, lacks ``config.json`` (or it
    is not JSON, or misses a field the model needs), or holds neither ``model.safetensors``
    nor ``model.safetensors.index.json``; and by ``models.hf.save`` when the target exists.
    Point at the folder that ``save_pretrained`` wrote (PyTorch ``.bin`` weights must be
    converted to safetensors first), or save into a new folder.
    """


class UnsupportedArchitectureError(MultiMeshError, ValueError):
    """A Hugging Face checkpoint describes a model the reference models cannot reproduce.

    ``models.hf`` reads ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``MistralForCausalLM``,
    ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` checkpoints with the features
    ``models.GPT`` and ``models.Llama`` implement. Another architecture, or a feature such
    as a rope type other than Llama 3.1's, Llama's ``attention_bias`` (a bias on the output
    projection too), Qwen's sliding-window layers or an exact-erf GELU in GPT-2, raises
    this; the message names the ``config.json`` fields and values (for another
    architecture: what it asks for that the reference models lack). ``models.hf.save``
    raises it for a config that no architecture it writes computes.
    """


class PretrainedTensorError(MultiMeshError, ValueError):
    """A checkpoint's tensors do not match its ``config.json``, or a file cannot be read.

    Raised for a missing tensor, a tensor the model does not have, a tensor of the wrong
    shape, a ``model.safetensors.index.json`` naming a file that is absent, and a truncated
    or corrupt ``.safetensors`` file; the message names the file and the key. When saving,
    raised for a parameter tree that is not the tree of ``models.GPT``/``models.Llama`` for
    the given config. Re-download or re-save the checkpoint, or fix ``config.json``.
    """


class VocabularySplitError(MultiMeshError, ValueError):
    """A vocabulary does not split evenly over the ``model`` axis it is sharded on.

    The token table and the output head shard their vocabulary dimension over the stage's
    ``model`` axis, so its size must be a multiple of that axis. Pass
    ``vocab_multiple=<model axis size>`` to ``models.hf.load``/``load_placed`` to pad the
    table with zero rows (the extra ids are never produced by the tokenizer; give
    ``vocab_size=`` to ``models.hf.save`` to cut them off again), or use a ``model`` axis
    that divides the vocabulary.
    """


# --- timelines ------------------------------------------------------------------------------


class TimelineDataError(MultiMeshError, ValueError):
    """A recorded timeline lacks what was asked of it.

    Raised when the timeline holds no events (nothing ran inside ``record_timeline``), when
    ``call`` names a call that was not recorded, or when a bubble is asked of a call that ran
    no pipeline unit. Record a ``jit`` call of a function that uses ``microbatch`` with tasks.
    """


# --- multi-process (jax.distributed) --------------------------------------------------------


class LaunchArgumentError(MultiMeshError, ValueError):
    """``launch``/``mmflax launch`` got a malformed process count, device count or command.

    Pass a positive ``n``, a positive ``devices_per_process`` and the command as a list of
    arguments (``[sys.executable, "train.py"]``), or after ``--`` on the command line.
    """


class DistributedSetupError(MultiMeshError, ValueError):
    """``multimesh_flax.distributed.initialize`` found a malformed launcher environment, or
    was called after JAX had already started. Call it first thing in the script, before any
    JAX operation, under ``mmflax launch`` or a cluster scheduler."""


class ProgramMismatchError(MultiMeshError, ValueError):
    """The processes of one job built different MPMD programs (a different model config, batch
    shape or schedule in one of them). Every process must run the same script with the same
    arguments; the message names the processes and what differs."""


class HostValuesError(MultiMeshError, ValueError):
    """``host_values`` got different arrays in different processes: a leaf that is not one
    array of the job (the same program output everywhere) but one each process made on its
    own devices (``jnp.asarray(x)`` in each process), so no process knows which one to
    send. Pass the program's outputs themselves; read a value each process computed alone
    with ``np.asarray`` in that process. The message names the leaf and both processes'
    devices."""


class ProcessLostError(MultiMeshError, ValueError):
    """Another process of the job stopped answering (it died or was killed). The message
    names it; this process stops instead of waiting for collectives that can never finish.

    Logged by the watchdog of ``multimesh_flax.distributed`` just before it ends the process
    (exit status 75), not raised into user code; a ``ValueError`` like every class here."""


class CoordinatorPortError(MultiMeshError, ValueError):
    """The TCP port chosen for the ``jax.distributed`` coordinator is already in use (another
    job, or one still exiting). Without the check, process 0 failed with "Failed to start RPC
    server" or crashed, and the others waited a minute. Pick another port (``launch(port=)``,
    ``MMFLAX_COORDINATOR``) or stop the program holding it; the message names the port."""


class CallSequenceError(MultiMeshError, ValueError):
    """The processes of one job ran different sequences of collective calls: a step, a
    checkpoint ``save``/``restore`` or ``host_values`` that one process ran and another did
    not (an extra step in one process, a save under ``if jax.process_index() == 0``), or
    one process stopped while another still ran such calls. Every process must run the same
    calls in the same order; the message names the processes, the call and its number.

    Logged just before the processes involved end (exit status 76), not raised into user
    code: the process is blocked in a collective that can never finish."""


class InputMismatchError(MultiMeshError, ValueError):
    """The processes of one job passed different values for an input of the same program
    (a global batch drawn with a per-process seed), so each device would get its shard from
    its own process's copy and a stage's inputs would be paired with another process's
    targets. Give every process the same global batch (the same seed), or give each process
    its own part of the batch as a global array (``jax.make_array_from_process_local_data``,
    ``parallelize_step(local_batch=...)``'s ``prepare_batch``). Checked on a program's first
    call; the message names the input and both processes."""


# --- planning -------------------------------------------------------------------------------


class UnitPatternError(MultiMeshError, ValueError):
    """The units of a model could not be found from the given patterns.

    Raised by ``find_units``/``profile_units`` for a model without default units and no
    ``patterns``, a pattern that is not a regular expression, an unknown role, a pattern
    that matches no submodule the model calls, or stems/heads not first/last in call order.
    Use the module paths ``tabulate`` shows (``blocks_\\d+``, ``encoder/layer_\\d+``).
    """


class ProfileArgumentError(MultiMeshError, ValueError):
    """``profile_units`` or ``measure_transfer`` got an argument it cannot use.

    An unknown ``mode`` or ``device``, a ``mesh_shape`` that is malformed or larger than the
    local devices (profile on a smaller submesh: ``predict`` scales to the plan's), or
    inputs without a leading batch dimension.
    """


class PlanMismatchError(MultiMeshError, ValueError):
    """A ``Plan`` does not fit the profile it is predicted from.

    Blocks per stage that do not add up to the profiled model's layers, a stage submesh
    without the profile's axes, a recomputation policy the profile did not cost, or a
    schedule the plan's sizes cannot build. Change the plan, or profile what it needs.
    """


class PlanArgumentError(MultiMeshError, ValueError):
    """``plan`` got a search space it cannot use.

    A ``devices`` count below 1, a ``memory_per_device`` that is not a byte count or a size
    such as ``"2GiB"``, a schedule the search cannot price stage by stage (interleaved ones
    put several stages on one submesh; search among ``"gpipe"``, ``"1f1b"``,
    ``"zero-bubble-h1"``, ``"zero-bubble-h2"``), microbatch counts that divide no batch, or
    no stage count whose submeshes divide the devices. Widen the search or fix the value.
    """


class PlanMemoryError(MultiMeshError, ValueError):
    """No plan in ``plan``'s search space fits ``memory_per_device``.

    The message names the smallest memory per device that any plan of the space needs and
    that plan (also in ``error.required_bytes`` and ``error.prediction``). Give more memory
    per device, more devices, more recomputation (``recompute=(None, "full")``), more
    microbatches, or a smaller batch.
    """

    def __init__(self, message: str, required_bytes: int | None = None, prediction=None):
        super().__init__(message)
        self.required_bytes = required_bytes
        self.prediction = prediction
