// keel::store_beast from the install: a server built, started on a free loopback port and
// stopped, through find_package(keel) and through pkg-config alike.
#include <keel/serve/beast/server.hpp>

int consumer_beast() {
  keel::store::beast::Server server;
  server.start();
  const bool listening = server.port() != 0;
  server.stop();
  return listening ? 0 : 1;
}
