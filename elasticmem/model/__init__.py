"""The trainable parts of ElasticMem: reasoner, budget policy, projector, injection, and the module that ties them."""
