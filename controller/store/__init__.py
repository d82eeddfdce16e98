"""specpilot's store: decisions, overrides, alerts, observations and learned state."""
