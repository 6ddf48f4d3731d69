"""The trainable parts of ElasticMem: reasoner, budget policy, projector, injection, and the module that ties them."""

from elasticmem.model.budget_policy import BudgetPolicy, BudgetPolicyConfig
from elasticmem.model.elasticmem import ElasticMem
from elasticmem.model.projector import Projector, ProjectorConfig
from elasticmem.model.trajectories import ScoreOutput, Trajectories

__all__ = ["BudgetPolicy", "BudgetPolicyConfig", "ElasticMem", "Projector", "ProjectorConfig", "ScoreOutput",
           "Trajectories"]
