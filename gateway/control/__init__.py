"""The control plane: heartbeats and their authentication, engine scraping, and the supervisor that launches and
restarts managed engines.
"""
