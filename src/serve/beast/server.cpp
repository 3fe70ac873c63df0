// keel::store::beast::Server: one Session per connection, on a strand of the event loop; each
// request read with deadlines per request (the first byte from the accept, the head from its first
// byte, the body from the end of the head), checked, routed, answered, then the next one (see
// keel/serve/beast/server.hpp). Sessions not having a request handled wait in one list, oldest
// first, from which a new connection at the limit takes its slot.
//
// Server's own methods are here; its state and the sessions are in detail/server_impl.hpp.
#include "keel/serve/beast/server.hpp"

#include <exception>
#include <mutex>
#include <string>
#include <utility>

#include "keel/idempotency/idempotency_flow.hpp"
#include "serve/beast/detail/server_impl.hpp"

namespace keel::store::beast {

Server::Server(ServerOptions options) : impl_(std::make_shared<Impl>(std::move(options))) {}

Server::~Server() { stop(); }

void Server::on(http::verb method, std::string path, LoopHandler handler) {
  Impl* impl = impl_.get();
  impl_->routes.push_back(
      {method, std::move(path),
       [impl, handler = std::move(handler)](const Request& request, const Respond& respond) {
         Response res;
         try {
           res = handler(request);
         } catch (const std::exception& e) {
           impl->options.log(std::string("a handler threw: ") + e.what());
           res = problem_response(500, problem_title(500),
                                  "the server failed to handle the request", request.version());
         }
         respond(std::move(res));
       }});
}

void Server::on_async(http::verb method, std::string path, AsyncHandler handler) {
  impl_->routes.push_back({method, std::move(path), std::move(handler)});
}

void Server::on_idempotent(http::verb method, std::string path, const IdempotentHandler& handler) {
  Impl* impl = impl_.get();
  impl_->routes.push_back(
      {method, std::move(path), [impl, &handler](Request request, Respond respond) {
         std::string principal = handler.principal(request);
         handler.async_handle(std::move(request), std::move(principal), handler.clock().now(),
                              impl->work->get_executor(), std::move(respond));
       }});
}

void Server::start() { impl_->start(); }

void Server::stop() { impl_->stop(); }

std::uint16_t Server::port() const noexcept { return impl_->port.load(); }

boost::asio::any_io_executor Server::worker_executor() const { return impl_->work->get_executor(); }

Response no_answer() {
  Response res;
  res.result(0);
  return res;
}

std::size_t Server::connections() const {
  std::lock_guard lock(impl_->mu);
  return impl_->sessions.size();
}

std::size_t Server::connection_limit() const noexcept { return impl_->limit.load(); }

std::size_t Server::stranded_workers() const {
  std::lock_guard lock(impl_->mu);
  return impl_->stranded;
}

}  // namespace keel::store::beast
