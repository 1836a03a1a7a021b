# Reads MINIKV_VERSION_{MAJOR,MINOR,PATCH} from include/minikv.h: the header is the only
# place the version is written.
function(minikv_read_version header out_var)
  file(STRINGS "${header}" lines REGEX "^#define MINIKV_VERSION_(MAJOR|MINOR|PATCH) [0-9]+")
  foreach(part MAJOR MINOR PATCH)
    string(REGEX MATCH "MINIKV_VERSION_${part} ([0-9]+)" _ "${lines}")
    set(v_${part} "${CMAKE_MATCH_1}")
    if(NOT v_${part} MATCHES "^[0-9]+$")
      message(FATAL_ERROR "MINIKV_VERSION_${part} not found in ${header}")
    endif()
  endforeach()
  set(${out_var} "${v_MAJOR}.${v_MINOR}.${v_PATCH}" PARENT_SCOPE)
endfunction()
