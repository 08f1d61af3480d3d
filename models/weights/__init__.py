"""A model's weights: drawn at random straight into their shards (`initialization`), or read from
a Hugging Face safetensors checkpoint with each device reading only its shards (`load`, FP8 ones
and quantizing on load in `fp8`), and written back as one (`save`)."""

from .load import CONFIG_FILE as CONFIG_FILE
from .load import INDEX_FILE as INDEX_FILE
from .load import SINGLE_FILE as SINGLE_FILE
from .load import check_checkpoint_files as check_checkpoint_files
from .load import load_config as load_config
from .load import load_params as load_params
from .load import load_tensor as load_tensor
from .load import read_hf_config_file as read_hf_config_file
from .load import read_json as read_json
from .save import check_destination as check_destination
from .save import replace_directory as replace_directory
from .save import save_checkpoint as save_checkpoint
from .save import stage_checkpoint as stage_checkpoint
