# Exported dynamic symbols of libminikv.so must be exactly the MINIKV_API functions
# declared in include/minikv.h, and those must include every function of the published
# contract below (the ABI is append-only: a function may be added, never removed).
#   cmake -DLIB=<libminikv.so> -DHEADER=<minikv.h> -DNM=<nm> -P check_symbols.cmake
# The 15 functions of DESIGN.md (0.1.0) plus later additions.
set(contract
  minikv_cache_backend
  minikv_append minikv_append_decode minikv_cache_create minikv_cache_destroy minikv_cache_last_error
  minikv_config_default minikv_config_init minikv_config_preset minikv_decode minikv_kept_positions
  minikv_last_error_message
  minikv_memory_stats_get minikv_prefill minikv_prefill_chunk minikv_sequence_length
  minikv_sequence_release
  minikv_status_string minikv_version_number minikv_version_string)
list(SORT contract)

execute_process(COMMAND "${NM}" -D --defined-only "${LIB}"
                OUTPUT_VARIABLE nm_out RESULT_VARIABLE rc ERROR_VARIABLE nm_err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D --defined-only ${LIB} failed: ${nm_err}")
endif()
string(REPLACE "\n" ";" lines "${nm_out}")
set(exported)
foreach(line IN LISTS lines)
  # "<address> <type> <name>[@version]"; absolute (A) entries are version nodes.
  if(line MATCHES "^[0-9a-fA-F]* *([A-Za-z]) ([^ @]+)")
    if(NOT CMAKE_MATCH_1 STREQUAL "A")
      list(APPEND exported "${CMAKE_MATCH_2}")
    endif()
  endif()
endforeach()
list(SORT exported)

file(READ "${HEADER}" header)
string(REGEX MATCHALL "MINIKV_API[^;(]*[ *](minikv_[a-z0-9_]+) *\\(" decls "${header}")
set(declared)
foreach(d IN LISTS decls)
  string(REGEX MATCH "(minikv_[a-z0-9_]+) *\\($" _ "${d}")
  list(APPEND declared "${CMAKE_MATCH_1}")
endforeach()
list(SORT declared)

set(ok TRUE)
if(NOT exported STREQUAL declared)
  set(extra ${exported})
  if(declared)
    list(REMOVE_ITEM extra ${declared})
  endif()
  set(missing ${declared})
  if(exported)
    list(REMOVE_ITEM missing ${exported})
  endif()
  message(SEND_ERROR "exported symbols of ${LIB} differ from the MINIKV_API declarations of "
                     "${HEADER}\n  exported but not declared: ${extra}\n  declared but not "
                     "exported: ${missing}")
  set(ok FALSE)
endif()
set(removed ${contract})
if(declared)
  list(REMOVE_ITEM removed ${declared})
endif()
if(removed)
  message(SEND_ERROR "functions of the published contract are no longer declared: ${removed}")
  set(ok FALSE)
endif()
foreach(name IN LISTS exported)
  if(NOT name MATCHES "^minikv_")
    message(SEND_ERROR "exported symbol without the minikv_ prefix: ${name}")
    set(ok FALSE)
  endif()
endforeach()
list(LENGTH exported n)
list(LENGTH contract n_contract)
if(ok)
  message(STATUS "libminikv exports exactly the ${n} minikv_* functions of its header "
                 "(contract: ${n_contract})")
else()
  message(FATAL_ERROR "ABI symbol check failed")
endif()
