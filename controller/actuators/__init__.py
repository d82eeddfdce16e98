"""Actuators: how a decision reaches the fleet."""
