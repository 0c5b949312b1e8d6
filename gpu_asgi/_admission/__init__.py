"""Admission: a tagged request's body read, checked and turned into a reservation."""
