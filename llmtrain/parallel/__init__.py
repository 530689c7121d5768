"""Processes and their layout: the process group, the rules of what composes with what."""
