"""Reports: bound plans in words (`plans`) and the collectives a compiled program runs, read from
its HLO (`collectives`)."""

from .collectives import KINDS as KINDS
from .collectives import Collective as Collective
from .collectives import CollectiveReport as CollectiveReport
from .collectives import collective_report as collective_report
from .collectives import describe_collectives as describe_collectives
from .collectives import parse_hlo as parse_hlo
from .plans import describe_path as describe_path
from .plans import describe_stages as describe_stages
from .plans import describe_steps as describe_steps
