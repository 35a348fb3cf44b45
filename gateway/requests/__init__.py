"""What a request is, shared by every room: the OpenAI types, the generation job, images, token estimates, exact
prompts and the errors a request can end with.
"""
