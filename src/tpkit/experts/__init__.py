"""Expert parallelism: a mixture-of-experts model's experts spread over ranks that hold different tokens, each
token sent to the rank of its expert by an all-to-all and back (`apply.expert_parallel`)."""
from .apply import ExpertParallel, expert_parallel, experts_of, KEEP_EXPERTS_WHOLE
from .balance import update_expert_bias

__all__ = ["ExpertParallel", "expert_parallel", "experts_of", "KEEP_EXPERTS_WHOLE", "update_expert_bias"]
