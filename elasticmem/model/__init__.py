"""The trainable parts of ElasticMem: reasoner, budget policy, projector, injection, and the module that ties them."""

from elasticmem.model.budget_policy import BudgetPolicy, BudgetPolicyConfig
from elasticmem.model.projector import Projector, ProjectorConfig

__all__ = ["BudgetPolicy", "BudgetPolicyConfig", "ElasticMem", "Projector", "ProjectorConfig", "ScoreOutput",
           "Trajectories"]


def __getattr__(name: str):
    # elasticmem.config imports the policy/projector configs from this package, and the model
    # module imports elasticmem.config: load it on first use to keep that cycle open.
    if name in ("ElasticMem", "ScoreOutput", "Trajectories"):
        from elasticmem.model import elasticmem as _m

        return getattr(_m, name)
    raise AttributeError(f"module 'elasticmem.model' has no attribute {name!r}")
