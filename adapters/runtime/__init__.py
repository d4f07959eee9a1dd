"""Process-wide JAX and host tuning: the compilation cache (and abstract models beside it), cheap tracing with its trace
registry, the host allocator.

- :mod:`.compilation`: JAX's persistent compilation cache, on by default.
- :mod:`.abstract_models`: each config's abstract Tunix model, pickled beside the compilation cache for the next
  process.
- :mod:`.tracing`: traces without garbage-collection passes, and :data:`.tracing.TRACE_COUNTS`, the count of every
  jitted program's traces.
- :mod:`.xla_cpu`: XLA:CPU's scheduler set to save memory (rematerialisation works on CPU).
- :mod:`.host_memory`: glibc ``malloc`` settings that keep freed XLA buffers mapped on CPU.
"""
