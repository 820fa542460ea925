"""The doors beside Django's views: the preview proxy, which answers preview hostnames before
Django sees the request, and the SSH gateway into harnesses. Imports none of its modules."""
