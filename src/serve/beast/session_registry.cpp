// Server::Impl's session registry: which sessions are open, and which wait for a request, oldest
// first, so that a new connection at the limit (or an accept out of descriptors) can take the
// slot of one that holds no request.
#include "serve/beast/detail/server_impl.hpp"

namespace keel::store::beast {

std::shared_ptr<Session> Server::Impl::admit(tcp::socket& socket,
                                             std::shared_ptr<Session>& victim) {
  std::lock_guard lock(mu);
  if (stopping) return nullptr;
  const std::size_t in_force = limit.load(std::memory_order_relaxed);
  if (sessions.size() - evicting >= in_force) victim = evict_oldest_locked();
  if (sessions.size() - evicting >= in_force) return nullptr;
  const std::uint64_t id = next_id++;
  auto session = std::make_shared<Session>(shared_from_this(), std::move(socket), id);
  sessions.emplace(id, session);
  session->waiting_at = waiting.insert(waiting.end(), session.get());
  session->waiting = true;
  return session;
}

std::shared_ptr<Session> Server::Impl::evict_oldest_locked() {
  for (auto it = waiting.begin(); it != waiting.end(); ++it) {
    Session* s = *it;
    // A session being destroyed (its destructor waits for mu) leaves by itself.
    std::shared_ptr<Session> alive = s->weak_from_this().lock();
    if (!alive) continue;
    waiting.erase(it);
    s->waiting = false;
    s->evicted = true;
    ++evicting;
    return alive;
  }
  return nullptr;
}

bool Server::Impl::wait(Session& s) {
  std::lock_guard lock(mu);
  if (s.evicted) return false;
  if (!s.waiting) {
    s.waiting_at = waiting.insert(waiting.end(), &s);
    s.waiting = true;
  }
  return true;
}

bool Server::Impl::handle(Session& s) {
  std::lock_guard lock(mu);
  if (s.evicted) return false;
  if (s.waiting) {
    waiting.erase(s.waiting_at);
    s.waiting = false;
  }
  return true;
}

void Server::Impl::closed(Session& s) {
  {
    std::lock_guard lock(mu);
    if (!s.registered) return;
    s.registered = false;
    sessions.erase(s.id());
    if (s.waiting) waiting.erase(s.waiting_at);
    s.waiting = false;
    if (s.evicted) --evicting;
  }
  all_closed.notify_all();
}

}  // namespace keel::store::beast
