"""The dashboard's pages: Django views rendering templates (htmx fragments included), their
forms and charts, and the team a browser session works in. Imports none of its modules."""
