// Closing a cpp-httplib connection once its answer is written. Private to keel::store_http.
#pragma once

#include <httplib.h>

namespace keel::store::detail {

/// Makes cpp-httplib close the connection once `response` (its body and Content-Type already
/// set) is written, so that request bytes not read yet are never parsed as another request.
void close_after_answer(httplib::Response& response);

}  // namespace keel::store::detail
