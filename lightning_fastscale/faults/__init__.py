"""Fault tolerance: checkpoint writing, the run-folder lock, exact resume, preemption, failed peers."""
