import sys
from pathlib import Path

import pytest

# Lets configs name test helpers as `module:function` (e.g. reward="reward_fns:length_reward").
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """A randomly initialised tiny base checkpoint (seed 0): fast runs that need no learning."""
    import torch

    from rlfusion.model.checkpoint import save_checkpoint
    from rlfusion.model.config import get_preset
    from rlfusion.model.tokenizer import CharTokenizer
    from rlfusion.model.transformer import MoETransformer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("base")
    save_checkpoint(path, MoETransformer(get_preset("tiny")), CharTokenizer.arithmetic())
    return path
