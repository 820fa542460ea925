"""The websockets: their routes, the consumers (terminals, streamed exec, live page updates),
who is on the other end (a token or a same-origin session) and what a client may send.
Imports none of its modules."""
