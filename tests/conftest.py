import sys
from pathlib import Path

# Lets configs name test helpers as `module:function` (e.g. reward="reward_fns:length_reward").
sys.path.insert(0, str(Path(__file__).parent))
