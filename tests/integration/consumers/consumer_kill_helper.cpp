// A consumer process for the SIGKILL drill (consumer_kill_drill_test.cpp): reads messages
// ("ID AMOUNT" lines) from a file, from the offset saved in OFFSET_FILE, applies each through
// keel::store::ProcessedMessages (a ledger row and a balance update in the record's
// transaction), then saves the next offset. The offset is saved after the commit, not with it,
// so a kill between the two redelivers the message: at least once, as a real broker does.
//
//   consumer_kill_helper DATABASE_URL INPUT_FILE OFFSET_FILE
//
// Exits 0 at the end of the input, 1 on an error.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <thread>

#include "keel/consumers/processed_messages.hpp"
#include "keel/db/database.hpp"

namespace store = keel::store;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: consumer_kill_helper DATABASE_URL INPUT_FILE OFFSET_FILE\n");
    return 2;
  }
  try {
    auto conn = store::open_database(store::parse_database_url(argv[1]).value());
    store::ProcessedMessages records({.consumer = "drill"});
    long offset = 0;
    if (std::ifstream saved(argv[3]); saved) saved >> offset;
    std::ifstream input(argv[2]);
    std::string id;
    std::int64_t amount = 0;
    for (long line = 0; input >> id >> amount; ++line) {
      if (line < offset) continue;
      const auto r = records.process(*conn, id, [&](store::Connection& tx) {
        tx.query("INSERT INTO ledger (message, amount) VALUES ($1, $2)", {id, amount});
        // Some work inside the transaction, so that kills land there too.
        std::this_thread::sleep_for(std::chrono::microseconds(300));
        tx.query("UPDATE balance SET total = total + $1", {amount});
        return true;
      });
      if (!r || !r->done()) {
        std::fprintf(stderr, "message %s: %s\n", id.c_str(),
                     r ? r->transaction.error.c_str() : r.error().message().c_str());
        return 1;
      }
      // Save the next offset: write a new file and rename it over the old one.
      const std::string tmp = std::string(argv[3]) + ".tmp";
      {
        std::ofstream out(tmp, std::ios::trunc);
        out << line + 1 << "\n";
      }
      std::rename(tmp.c_str(), argv[3]);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
    return 1;
  }
}
