"""Test doubles of outside servers, speaking their real wire formats."""
