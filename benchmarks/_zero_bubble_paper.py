"""Published inputs and results of the Zero Bubble paper (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024, arXiv 2401.10241), for checking ``simulate`` and our schedules.

* :data:`TABLE9`: its Appendix D, Table 9, the profiled ``T_F``, ``T_B``, ``T_W`` and
  ``T_comm`` (ms) of each setup, which the paper feeds to every schedule for Table 5.
* :data:`TABLE5`: its Table 5, the bubble rate ``(cost - m (T_F + T_B + T_W)) / cost`` of
  each schedule, ``cost`` being the longest row's time (our ``steady_bubble_fraction``).
* :data:`MODELS`: its Table 3, hidden size ``h``, attention heads ``a`` and sequence length
  ``s``, from which its Table 1 gives the memory a set keeps for ``W``:
  ``M_W / M_B = 32 h / (34 h + 5 a s)`` (:func:`w_share`). ZB-1p and ZB-2p hold at most
  ``p`` and ``2 p`` times ``M_B`` with that accounting.

The numbers are the paper's, typed in; nothing here is computed by this project.
"""

from __future__ import annotations

from typing import NamedTuple


class Setup(NamedTuple):
    """One row of Table 9: a model on ``p`` stages with ``m`` microbatches, times in ms."""

    model: str
    p: int
    m: int
    f: float
    b: float
    w: float
    comm: float

    @property
    def costs(self) -> dict[str, float]:
        """The costs as ``simulate`` and ``make_schedule`` take them."""
        return {"F": self.f, "B": self.b, "W": self.w, "transfer": self.comm}


class Rates(NamedTuple):
    """One row of Table 5: the published bubble rates."""

    one_f_one_b: float
    interleaved: float
    zb_h1: float
    zb_h2: float
    zb_1p: float
    zb_2p: float


TABLE9 = (
    Setup("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601),
    Setup("1.5B", 8, 32, 18.513, 18.086, 9.331, 0.626),
    Setup("1.5B", 8, 64, 18.546, 18.097, 9.321, 0.762),
    Setup("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527),
    Setup("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577),
    Setup("6.2B", 8, 64, 29.935, 29.621, 19.388, 0.535),
    Setup("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377),
    Setup("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379),
    Setup("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.378),
    Setup("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408),
    Setup("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408),
    Setup("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460),
)

TABLE5 = (
    Rates(0.2431, 0.1055, 0.1585, 0.1083, 0.1585, 0.0433),
    Rates(0.1985, 0.0818, 0.1242, 0.0837, 0.1242, 0.0039),
    Rates(0.1240, 0.0443, 0.0674, 0.0444, 0.0674, 0.0026),
    Rates(0.2347, 0.0808, 0.1323, 0.0698, 0.1323, 0.0029),
    Rates(0.1898, 0.0628, 0.1045, 0.0559, 0.1045, 0.0022),
    Rates(0.1091, 0.0320, 0.0554, 0.0294, 0.0554, 0.0010),
    Rates(0.2552, 0.1104, 0.1397, 0.0672, 0.1397, 0.0066),
    Rates(0.2082, 0.0852, 0.1088, 0.0516, 0.1088, 0.0054),
    Rates(0.1251, 0.0445, 0.0576, 0.0266, 0.0576, 0.0028),
    Rates(0.2646, 0.1493, 0.1421, 0.0641, 0.1421, 0.0038),
    Rates(0.2168, 0.1164, 0.1106, 0.0490, 0.1106, 0.0029),
    Rates(0.1352, 0.0624, 0.0594, 0.0257, 0.0594, 0.0018),
)

# Table 3: (hidden size h, attention heads a, sequence length s) per model.
MODELS = {
    "1.5B": (2304, 24, 1024),
    "6.2B": (4096, 32, 1024),
    "14.6B": (5120, 40, 1024),
    "28.3B": (6144, 48, 1024),
}


def w_share(model: str) -> float:
    """``M_W / M_B`` of a transformer layer by the paper's Table 1: ``32 h / (34 h + 5 a s)``."""
    h, a, s = MODELS[model]
    return 32 * h / (34 * h + 5 * a * s)
