"""A small text toolkit, built by the exec-phase example's agents."""
