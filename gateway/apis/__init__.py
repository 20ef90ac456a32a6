"""The other APIs agents speak, as one translation layer over the chat-completions path.

``/v1/responses`` (OpenAI's Responses API) and ``/v1/messages`` (Anthropic's Messages API) are
translated into chat-completions bodies (:mod:`.responses_request`, :mod:`.messages_request`),
run through the gateway's own request path in process (:mod:`.bridge`: the same auth, limits,
routing, failover, resume and decision headers), and their replies and streams translated back
(:mod:`.chat_events` reads a chat reply as events; :mod:`.responses_reply` and
:mod:`.messages_reply` write each API's shapes). Stored responses live in
:mod:`.response_store`; the routes are in :mod:`.routes`.
"""
