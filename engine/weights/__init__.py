"""The learner -> generator weight channel (``channel``)."""
