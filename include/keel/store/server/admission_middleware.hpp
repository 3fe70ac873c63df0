// Moved to <keel/serve/httplib/admission_middleware.hpp> (headers mirror the rooms of src/). This
// forwarding header stays for one release (CHANGELOG.md, "Headers by room"); include the new path.
#pragma once

#include "keel/serve/httplib/admission_middleware.hpp"
