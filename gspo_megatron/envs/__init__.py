"""Multi-turn rollouts: environments (:mod:`.base`), where they run (:mod:`.workers`), the turn
loop on the rollout engine (:mod:`.turns`) and built-in tools (:mod:`.tools`)."""

from gspo_megatron.envs.base import Environment, ToolCallError, parse_tool_calls
from gspo_megatron.envs.turns import EPISODE_KEY, POLICY_MASK_KEY, Episodes, TurnDriver

__all__ = ["EPISODE_KEY", "POLICY_MASK_KEY", "Environment", "Episodes", "ToolCallError",
           "TurnDriver", "parse_tool_calls"]
