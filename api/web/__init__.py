"""The web pages for people: the routes and forms, and the SVG plots drawn on the server."""
