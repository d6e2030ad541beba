"""Profiles the planner tests share, computed once per worker (the tests run on one)."""

from tests.planner._planning_models import gpt_profile as gpt_profile
from tests.planner._planning_models import mlp_profile as mlp_profile
