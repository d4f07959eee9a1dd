"""Process-wide JAX and host tuning: the compilation cache, cheap tracing with its trace registry, the host allocator.

- :mod:`.compilation`: JAX's persistent compilation cache, on by default.
- :mod:`.tracing`: traces without garbage-collection passes, and :data:`.tracing.TRACE_COUNTS`, the count of every
  jitted program's traces.
- :mod:`.host_memory`: glibc ``malloc`` settings that keep freed XLA buffers mapped on CPU.
"""
