// The Worker's gate for jobs that must run alone (queue/detail/worker_decision.hpp): a suspect
// job's start and handler run with no other handler of the worker running, so that a crash then
// is charged to it alone. Every other handler of a batched worker passes the gate shared. A job
// waiting to run alone goes first: no shared pass begins while one waits, so a busy worker cannot
// keep it out.
#pragma once

#include <condition_variable>
#include <mutex>

namespace keel::store::detail {

class AloneGate {
 public:
  // Held for one handler: alone (exclusive), or shared with the worker's other handlers.
  class Pass {
   public:
    Pass(AloneGate* gate, bool alone) : gate_(gate), alone_(alone) {
      if (gate_ != nullptr) gate_->enter(alone_);
    }
    ~Pass() {
      if (gate_ != nullptr) gate_->leave(alone_);
    }
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;

   private:
    AloneGate* gate_;
    bool alone_;
  };

  void enter(bool alone) {
    std::unique_lock lock(mu_);
    if (alone) {
      ++waiting_alone_;
      // wait: bound: the handlers running now, each to its end
      cv_.wait(lock, [&] { return shared_ == 0 && !alone_; });
      --waiting_alone_;
      alone_ = true;
      return;
    }
    // wait: bound: the one job running alone, and those waiting to
    cv_.wait(lock, [&] { return !alone_ && waiting_alone_ == 0; });
    ++shared_;
  }

  void leave(bool alone) {
    {
      std::lock_guard lock(mu_);
      if (alone) {
        alone_ = false;
      } else {
        --shared_;
      }
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int shared_ = 0;         // handlers running shared; guarded by mu_
  int waiting_alone_ = 0;  // jobs waiting to run alone; guarded by mu_
  bool alone_ = false;     // a job runs alone; guarded by mu_
};

}  // namespace keel::store::detail
