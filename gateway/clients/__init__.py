"""Clients of the engines: the pooled gRPC session to managed engines and the HTTP client to kind: openai
upstreams, with the fields each engine honours.
"""
