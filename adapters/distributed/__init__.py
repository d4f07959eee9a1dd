"""Device meshes and placement (:mod:`.mesh`) and work split over JAX processes (:mod:`.multihost`)."""
