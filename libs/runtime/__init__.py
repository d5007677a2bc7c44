"""What every service process shares."""
