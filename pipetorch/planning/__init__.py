"""Compile-time planning: the memory model and estimate, segment costs, balancing and `plan`."""
