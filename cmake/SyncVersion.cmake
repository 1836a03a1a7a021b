# cmake -P script: the version is written once, in include/minikv.h
# (MINIKV_VERSION_MAJOR/MINOR/PATCH); every other file that must carry it is listed below.
#   -DMODE=check               fail, naming each file, when one differs from the header
#   -DMODE=write -DVERSION=X.Y.Z   write X.Y.Z into the header and every file below
# scripts/version.sh is the front end; CTest runs the check (version.consistent).
cmake_minimum_required(VERSION 3.16)
get_filename_component(root "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
include("${CMAKE_CURRENT_LIST_DIR}/MinikvVersion.cmake")

if(MODE STREQUAL "write")
  if(NOT VERSION MATCHES "^([0-9]+)\\.([0-9]+)\\.([0-9]+)$")
    message(FATAL_ERROR "VERSION must be MAJOR.MINOR.PATCH (got '${VERSION}')")
  endif()
  # minikv_version_number() is major*10000 + minor*100 + patch: minor and patch < 100.
  if(CMAKE_MATCH_2 GREATER 99 OR CMAKE_MATCH_3 GREATER 99)
    message(FATAL_ERROR "minor and patch must be below 100 (got '${VERSION}')")
  endif()
elseif(MODE STREQUAL "check")
  minikv_read_version("${root}/include/minikv.h" VERSION)
else()
  message(FATAL_ERROR "MODE must be check or write")
endif()
string(REPLACE "." ";" parts "${VERSION}")
list(GET parts 0 major)
list(GET parts 1 minor)
list(GET parts 2 patch)
math(EXPR number "${major} * 10000 + ${minor} * 100 + ${patch}")

set(changed "")
# site(<file> <count> <regex> <replacement>): the regex must match exactly <count> times in
# <file>; each match must read as the replacement (check) or is replaced by it (write).
function(site file count regex replacement)
  set(path "${root}/${file}")
  if(NOT EXISTS "${path}")
    message(FATAL_ERROR "${file}: missing (cmake/SyncVersion.cmake lists it)")
  endif()
  file(READ "${path}" text)
  string(REGEX MATCHALL "${regex}" hits "${text}")
  list(LENGTH hits n)
  if(NOT n EQUAL count)
    message(FATAL_ERROR "${file}: '${regex}' matches ${n} times, expected ${count}: "
                        "update cmake/SyncVersion.cmake with the file's new form")
  endif()
  string(REGEX REPLACE "${regex}" "${replacement}" synced "${text}")
  if(NOT synced STREQUAL text)
    if(MODE STREQUAL "write")
      file(WRITE "${path}" "${synced}")
    endif()
    set(changed ${changed} ${file} PARENT_SCOPE)
  endif()
endfunction()

foreach(part MAJOR MINOR PATCH)
  string(TOLOWER ${part} p)
  site(include/minikv.h 1 "#define MINIKV_VERSION_${part} [0-9]+"
       "#define MINIKV_VERSION_${part} ${${p}}")
  # Generated from the header by SWIG and bindgen (CI regenerates both and fails on a diff);
  # kept in step here so that a version change needs neither tool.
  site(bindings/go/internal/capi/capi.go 1 "const MINIKV_VERSION_${part} int = [0-9]+"
       "const MINIKV_VERSION_${part} int = ${${p}}")
  site(bindings/rust/minikv-sys/src/bindings.rs 1 "pub const MINIKV_VERSION_${part}: u32 = [0-9]+"
       "pub const MINIKV_VERSION_${part}: u32 = ${${p}}")
endforeach()
site(bindings/rust/minikv-sys/src/bindings.rs 1 "pub const MINIKV_VERSION_NUMBER: u32 = [0-9]+"
     "pub const MINIKV_VERSION_NUMBER: u32 = ${number}")
set(v "[0-9]+\\.[0-9]+\\.[0-9]+")
site(bindings/python/pyproject.toml 1 "\nversion = \"${v}\"" "\nversion = \"${VERSION}\"")
site(bindings/python/minikv/_version.py 1 "\nVERSION = \"${v}\"" "\nVERSION = \"${VERSION}\"")
foreach(manifest bindings/rust/minikv-sys/Cargo.toml bindings/rust/minikv/Cargo.toml
                 examples/rust/Cargo.toml)
  site(${manifest} 1 "\nversion = \"${v}\"" "\nversion = \"${VERSION}\"")
endforeach()
site(bindings/rust/minikv/Cargo.toml 1 "path = \"../minikv-sys\", version = \"${v}\""
     "path = \"../minikv-sys\", version = \"${VERSION}\"")
foreach(lock bindings/rust/minikv-sys/Cargo.lock:1 bindings/rust/minikv/Cargo.lock:2
             examples/rust/Cargo.lock:3)
  string(REPLACE ":" ";" lock "${lock}")
  list(GET lock 0 file)
  list(GET lock 1 count)
  site(${file} ${count} "name = \"(minikv|minikv-sys|minikv-example)\"\nversion = \"${v}\""
       "name = \"\\1\"\nversion = \"${VERSION}\"")
endforeach()

list(REMOVE_DUPLICATES changed)
if(MODE STREQUAL "write")
  foreach(file IN LISTS changed)
    message(STATUS "wrote ${VERSION} into ${file}")
  endforeach()
elseif(changed)
  list(JOIN changed "\n  " listing)
  message(FATAL_ERROR "these files do not carry include/minikv.h's version ${VERSION}:\n"
                      "  ${listing}\n"
                      "run scripts/version.sh ${VERSION} (or the version you mean) and commit")
else()
  message(STATUS "version ${VERSION}: every file that carries it agrees with include/minikv.h")
endif()
