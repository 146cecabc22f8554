"""Everything that needs fairscale: its two strategies and what they are built from.

- :mod:`.sharded_ddp`: ``ShardedDDPStrategy`` (``ShardedDataParallel`` + ``OSS``).
- :mod:`.fsdp`: ``FairScaleFSDPStrategy``, with :mod:`.wrap` (how the model is wrapped), :mod:`.layout` (where each
  canonical parameter lives in the flat shards), :mod:`.flat_state` (canonical state to and from the shards),
  :mod:`.gradients` (gradients around a step), :mod:`.options` and :mod:`.shards` (its sharded checkpoints).
- :mod:`.cpu`: the scoped patches that run fairscale FSDP on the CPU.
- :mod:`._private`: every fairscale-private name the package reads, calls, overrides or replaces; nothing else
  names one.

``_private``, ``cpu`` and ``layout`` import no Lightning package and are imported by absolute name, so both bindings
(``lightning_strategies`` and ``lightning_strategies.lightning``) share them. This module imports nothing: the
strategies are exported from the package's top level.
"""
