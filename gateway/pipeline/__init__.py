"""The request's path through the gateway: admission, routing on the state table, the attempt on a client, retries,
breakers, and the request log and metrics it leaves.
"""
