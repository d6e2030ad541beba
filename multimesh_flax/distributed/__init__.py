"""Multi-process runs through ``jax.distributed``: launcher, setup, cross-process transfers."""

from multimesh_flax.distributed._agree import any_process as any_process
from multimesh_flax.distributed._launch import LaunchResult as LaunchResult
from multimesh_flax.distributed._launch import launch as launch
from multimesh_flax.distributed._sequence import collective_call as collective_call
from multimesh_flax.distributed._setup import initialize as initialize
from multimesh_flax.distributed._setup import launched as launched
from multimesh_flax.distributed._wire import host_values as host_values
