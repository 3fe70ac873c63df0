// Moved to <keel/core/idempotency_key.hpp> (headers mirror the rooms of src/). This forwarding
// header stays for one release (CHANGELOG.md, "Headers by room"); include the new path.
#pragma once

#include "keel/core/idempotency_key.hpp"
