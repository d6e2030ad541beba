"""Planning a pipeline: costs per unit of a model, and a plan's predicted step and memory.

* `find_units` (``_units``): the units of a model -- the reference models' stem, block and
  head, or the submodules matching ``register_task``-style patterns -- identical ones once.
* `profile_units` (``_profile``): each distinct unit compiled on one submesh shape; its
  forward, activation-gradient, weight-gradient and optimizer-update programs analysed by
  XLA (``analytic``) or also timed (``measured``); state, activation and temporary bytes
  per device. `measure_transfer` times moves between two devices or submeshes
  (``_transfer``), as the runtime moves a stage's output.
* `predict` (``_predict``): a `Plan` (blocks per stage, submesh per stage, schedule,
  microbatches, recomputation per stage) turned into a `Prediction`: step time and bubble
  from the simulator over the unit costs, peak bytes per device, each number tagged with
  its `Source`.
* `plan` (``_planning``, over ``_search`` and the dynamic program of ``_split``): the
  plans of a search space, ranked by predicted step time (`Plans`); `PlanMemoryError` when
  none fits.
* `AppliedPlan` (``_apply``): a plan as the runtime takes it (``Prediction.apply()``).
* ``_report``: ``Plans.table()``, ``Prediction.table()`` and ``Prediction.plot()``.
* `profile_from_costs` (``_synthetic``): a profile from numbers you know (`CostSpec`).
* ``_costs``: the records: `Source`, `DeviceSpec`, `PhaseCost`, `TransferCost`.
"""

from multimesh_flax.planner._apply import AppliedPlan as AppliedPlan
from multimesh_flax.planner._costs import DEVICE_SPECS as DEVICE_SPECS
from multimesh_flax.planner._costs import DeviceSpec as DeviceSpec
from multimesh_flax.planner._costs import PhaseCost as PhaseCost
from multimesh_flax.planner._costs import Source as Source
from multimesh_flax.planner._costs import StateLeaf as StateLeaf
from multimesh_flax.planner._costs import TransferCost as TransferCost
from multimesh_flax.planner._planning import Plans as Plans
from multimesh_flax.planner._planning import parse_bytes as parse_bytes
from multimesh_flax.planner._planning import plan as plan
from multimesh_flax.planner._predict import Plan as Plan
from multimesh_flax.planner._predict import Prediction as Prediction
from multimesh_flax.planner._predict import StageCost as StageCost
from multimesh_flax.planner._predict import peak_activation_bytes as peak_activation_bytes
from multimesh_flax.planner._predict import predict as predict
from multimesh_flax.planner._profile import UnitCost as UnitCost
from multimesh_flax.planner._profile import UnitProfile as UnitProfile
from multimesh_flax.planner._profile import profile_units as profile_units
from multimesh_flax.planner._synthetic import CostSpec as CostSpec
from multimesh_flax.planner._synthetic import profile_from_costs as profile_from_costs
from multimesh_flax.planner._transfer import measure_transfer as measure_transfer
from multimesh_flax.planner._units import Instance as Instance
from multimesh_flax.planner._units import Unit as Unit
from multimesh_flax.planner._units import UnitSet as UnitSet
from multimesh_flax.planner._units import find_units as find_units
