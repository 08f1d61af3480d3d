"""Adapters: layer entries and exits that a plain prepare -> compute -> finish cannot express,
running plans that binding made (branches)."""

from .branch import branch_input as branch_input
from .branch import branch_output as branch_output
from .branch import merge_branch as merge_branch
