"""Ascend runtime probes: checks and readings taken at the attach points, reported as
incidents and probe metrics through the guard's incident pipeline (`probes.report`)."""
