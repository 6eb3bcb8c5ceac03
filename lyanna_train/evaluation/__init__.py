"""Measuring heads: teacher-forced agreement with the target."""
