// Command caddy is Caddy with its standard modules and allot's
// http.handlers.allot: the main package xcaddy generates for
// `xcaddy build --with github.com/allot/allot/integrations/caddy`.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/allot/allot/integrations/caddy"
)

func main() { caddycmd.Main() }
