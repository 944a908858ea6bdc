"""HTTP routes: thin, each calls one function of `services.api.queries` or `services.api.commands`."""
