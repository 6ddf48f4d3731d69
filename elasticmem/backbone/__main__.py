"""``python -m elasticmem.backbone fetch smollm2`` and the other commands of ``elasticmem.backbone.cli``."""

from elasticmem.backbone.cli import main

main()
