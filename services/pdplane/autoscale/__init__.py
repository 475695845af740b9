"""Autoscaling: a controller that turns live load and the planner's fleet simulation into
prefill/decode instance counts, and the actuators that carry them out (docs/autoscale.md)."""
