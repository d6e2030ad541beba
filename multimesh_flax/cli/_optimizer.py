"""The optimizer of an ``mmflax train`` run: AdamW, gradient clipping and the learning rate.

`OptimizerSettings` gathers the options that shape the update (``--lr``, ``--warmup``,
``--lr-schedule``, ``--min-lr-ratio``, ``--clip-norm``); `OptimizerSettings.of` reads them
from a run's saved settings, where a run older than an option lacks its key and gets the
default. `make_schedule` turns them into an optax schedule and `make_optimizer` into the
run's ``GradientTransformation``; `check_schedule` rejects a cosine decay that has no steps
to decay over.

**The schedule.** Optax calls the schedule with the count of updates applied before the
current one, so step ``s`` (counted from 1) uses ``rate(s - 1)`` -- fewer when
``--on-nonfinite skip`` skipped updates. The rate rises linearly from 0 at count 0 to
``lr`` at count ``warmup``; then

* ``constant`` (the default) stays at ``lr``: the rate does not depend on the run's length;
* ``cosine`` follows half a cosine from ``lr`` down to ``min_lr_ratio * lr``, reached at
  count ``horizon - 1``, the last step of a run of ``horizon`` steps, and stays there after.

``horizon`` is the step the run is going to, which every checkpoint records
(``target_step``): ``--resume`` after an interruption rebuilds the same schedule. Extending
a finished run with ``--resume --steps N`` moves the horizon to the new last step, so the
decay is stretched from there (the rate jumps to the stretched curve's value).

**Clipping.** The gradient's global norm is clipped to ``clip_norm`` before AdamW (``b2``
0.95, weight decay 0.01); ``clip_norm`` 0 clips nothing. Unclipped, the chain keeps the
same state tree (``optax.identity`` in the clip's place), so checkpoints look alike.

Example:
  >>> settings = OptimizerSettings(lr=1.0, warmup=2, lr_schedule="cosine", min_lr_ratio=0.1)
  >>> rate = make_schedule(settings, horizon=7)
  >>> [round(float(rate(count)), 3) for count in range(7)]
  [0.0, 0.5, 1.0, 0.868, 0.55, 0.232, 0.1]
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import optax

from multimesh_flax.cli.errors import RunOptionError

LR_SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """The options that shape a run's update (see the module docstring).

    Attributes:
        lr: AdamW's peak rate, reached after ``warmup`` updates.
        warmup: updates of the linear warm-up from 0.
        lr_schedule: ``"constant"`` or ``"cosine"`` after the warm-up.
        min_lr_ratio: ``cosine``'s final rate as a share of ``lr``.
        clip_norm: the global gradient norm clipped to; 0 clips nothing.
    """

    lr: float
    warmup: int
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.1
    clip_norm: float = 1.0

    @classmethod
    def of(cls, settings: Mapping[str, Any]) -> OptimizerSettings:
        """The settings among ``settings`` (a run's saved settings, or options as a dict)."""
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: settings[name] for name in names if name in settings})


def check_settings(settings: OptimizerSettings) -> None:
    """Raises `RunOptionError` for a value out of range (before anything is built)."""
    if settings.lr_schedule not in LR_SCHEDULES:
        raise RunOptionError(
            f"Unknown `--lr-schedule` {settings.lr_schedule!r}; choose one of {LR_SCHEDULES}."
        )
    if not (math.isfinite(settings.min_lr_ratio) and 0.0 <= settings.min_lr_ratio <= 1.0):
        raise RunOptionError(
            f"Expected `--min-lr-ratio` between 0 and 1 (the final rate of `--lr-schedule "
            f"cosine` as a share of `--lr`), got {settings.min_lr_ratio!r}. Use e.g. "
            "`--min-lr-ratio 0.1`."
        )
    if not (math.isfinite(settings.clip_norm) and settings.clip_norm >= 0):
        raise RunOptionError(
            f"Expected `--clip-norm` to be a positive number (the global gradient norm to clip "
            f"to), or 0 or 'none' to clip nothing, got {settings.clip_norm!r}."
        )


def check_schedule(settings: OptimizerSettings, horizon: int) -> None:
    """Raises `RunOptionError` when a cosine decay has no step left after the warm-up.

    Args:
        settings: the run's optimizer settings.
        horizon: the step the run is going to (its last step).
    """
    if settings.lr_schedule == "cosine" and horizon - 1 - settings.warmup < 1:
        raise RunOptionError(
            f"`--lr-schedule cosine` decays after the `--warmup` of {settings.warmup} steps "
            f"until the run's last step, {horizon}, which leaves nothing to decay over. Use "
            f"`--warmup` <= {max(horizon - 2, 0)}, more `--steps`, or `--lr-schedule constant`."
        )


def make_schedule(settings: OptimizerSettings, horizon: int | None = None) -> optax.Schedule:
    """The learning rate as a function of the count of updates applied.

    Args:
        settings: the run's optimizer settings.
        horizon: the run's last step; needed by ``cosine`` only.

    Raises:
        RunOptionError: ``cosine`` without a horizon past the warm-up (`check_schedule`).
    """
    lr, warmup = settings.lr, settings.warmup
    if settings.lr_schedule == "cosine":
        if horizon is None:
            raise RunOptionError("`--lr-schedule cosine` needs the run's last step (`horizon`).")
        check_schedule(settings, horizon)
        after = optax.cosine_decay_schedule(
            lr, decay_steps=horizon - 1 - warmup, alpha=settings.min_lr_ratio
        )
    else:
        after = optax.constant_schedule(lr)
    if warmup <= 0:
        return after
    ramp = optax.linear_schedule(0.0, lr, warmup)
    return optax.join_schedules([ramp, after], [warmup])


def make_optimizer(
    settings: OptimizerSettings, horizon: int | None = None
) -> optax.GradientTransformation:
    """AdamW (``b2`` 0.95, weight decay 0.01) at `make_schedule`'s rate, after clipping.

    Raises:
        RunOptionError: see `make_schedule`.
    """
    clip = optax.clip_by_global_norm(settings.clip_norm) if settings.clip_norm else optax.identity()
    rate = make_schedule(settings, horizon)
    return optax.chain(clip, optax.adamw(rate, b2=0.95, weight_decay=0.01))
