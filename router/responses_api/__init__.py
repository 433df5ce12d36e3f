"""OpenAI's Responses API (POST /v1/responses), stateless, as a second front on the chat
path: `request` reads a Responses body into the chat request it means (messages, tools,
tool choice, sampling); `answer` writes the chat path's result as a Response object or
its stream of events. Nothing is stored: `store: true` and `previous_response_id` are
refused. Plain Python: no Ray, no tensors.
"""
