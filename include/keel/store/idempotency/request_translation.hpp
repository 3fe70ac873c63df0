// Moved to <keel/idempotency/request_translation.hpp> (headers mirror the rooms of src/). This
// forwarding header stays for one release (CHANGELOG.md, "Headers by room"); include the new path.
#pragma once

#include "keel/idempotency/request_translation.hpp"
